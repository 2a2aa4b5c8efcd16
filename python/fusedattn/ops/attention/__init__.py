"""Dense and packed attention: `fusedattn.attention` and `fusedattn.varlen_attention` (the paged
prefill included). api.py is the dispatch; see its docstring for the files."""
