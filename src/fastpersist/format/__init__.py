"""On-disk formats: pure layout and parsing, no I/O engine and no torch.distributed."""
