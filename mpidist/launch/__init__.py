"""Starting a job: torchrun's environment for programs started by an MPI launcher (``environment``),
and ``mpidistrun``, torchrun's command line over an MPI launcher (``run``)."""
