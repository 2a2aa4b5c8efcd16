"""KV-cache decoding: `fusedattn.attention_with_kvcache`. api.py is the dispatch; see its
docstring for the files."""
