"""MLA (multi-head latent attention) decoding: `fusedattn.mla_attention_with_kvcache`. api.py is
the dispatch; the kernel is triton_kernels/mla.py."""
