"""The I/O engine: aligned buffers, O_DIRECT files, the pipelined writer and the parallel reader.

This layer knows bytes, memory and file descriptors; it never sees a state dict.
"""
