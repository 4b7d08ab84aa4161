"""Quantization as pure functions: scales and amax, quantize / dequantize, rounding noise,
the Hadamard rotation, scale layouts, checks of loaded scales, and the health signals
of a cast."""
