"""`mtp bench`: plain vs MTP speculative decoding vs transformers on the same weights, and the cost model."""
