"""What the sampler and its trainers agree on: the one part of `trainer_client` the server imports.

- `protocol`: the wire models (`Group`, `Sample`, `Heartbeat`, the request and response
  bodies, the error body) and the media types;
- `wire`: their msgpack codec (groups with raw little-endian number arrays);
- `flags`: command lines generated from pydantic settings models (`serve` and `train`
  both build theirs with it);
- `dtypes`: the dtypes weights travel in, under torch's and safetensors' names.

It depends on pydantic, numpy and msgpack alone, so that either side imports it without
the other's dependencies: a trainer node gets no FastAPI or engine, the server gets no
trainer. Importing this package imports none of its modules.
"""
