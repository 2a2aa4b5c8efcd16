"""fusedattn.linear: the batch-invariant matmul of a decoder step's projections."""
