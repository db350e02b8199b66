"""Export a variant for a serving system outside reco (one module per target: .triton)."""
