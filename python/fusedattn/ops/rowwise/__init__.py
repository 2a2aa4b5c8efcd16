"""The row-wise ops: `fusedattn.layer_norm`, `fusedattn.rms_norm` and `fusedattn.softmax`.
api.py is the dispatch; see its docstring for the files."""
