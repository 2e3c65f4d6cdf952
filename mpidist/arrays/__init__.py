"""The array layer: the only code that knows which kinds of arrays exist.

* ``dtypes``: the supported element types (one table) and the error for others;
* ``host``: numpy arrays and torch CPU tensors, the readiness check and staging
  (``prepare_*``), write-backs, memory layout (overlap, displacements);
* ``device``: GPU memory (``DeviceArray``) and the runtime operations on it.
"""
