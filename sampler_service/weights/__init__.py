"""Where weights live: every check, step and piece of state between a new policy and the
engine that serves it.

- `vetting`: a weight file against the engine's tensor specs, before anything loads.
- `nccl`: the NCCL transfer's request models, its update vetting and the rank layout of a
  pool of replicas (no I/O).
- `manager`: `WeightsManager`, what the routes call: the version check, the pause,
  install, persist and restore.

The dtype table both sides of the wire read is `trainer_client.contract.dtypes`: a
trainer imports no server module. The engines' side of the surface (load tensors, load
files, the NCCL calls) is declared on `sampler_service.backends.base.Backend`.
"""
