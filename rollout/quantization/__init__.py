"""The quantized generator's formats and kernels: the quantization recipes, fp8, re-quantizing received weights, and the
int8/int4 matmul kernels (Triton on CUDA, C++ on CPU in csrc/)."""
