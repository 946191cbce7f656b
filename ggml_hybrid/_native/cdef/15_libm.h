// The C library's single-precision logarithm: llama.cpp derives its YaRN RoPE factors and attention
// scales with logf, and a correctly rounded log (numpy's) differs from it in the last bit for some inputs.
float logf(float x);
