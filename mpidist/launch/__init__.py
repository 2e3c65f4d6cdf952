"""Starting a job: torchrun's environment for programs started by an MPI launcher."""
