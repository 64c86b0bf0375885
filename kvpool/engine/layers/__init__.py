"""The building blocks a model file is drawn with, each choosing its fastest form at load time
or per step: linear layers (dense, oneDNN-packed, 4-bit, 8-bit), the RMSNorm that may carry
the residual add, the gated activation, rotary embeddings, and the native decode loop that runs
a whole stack of them when every layer takes it."""
