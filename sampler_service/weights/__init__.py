"""Where weights live: every check, step and piece of state between a new policy and the
engine that serves it.

- `types`: a tensor's spec, the NCCL transfer's description, the refusals, and
  `WeightTarget`: the engine as the manager drives it.
- `vetting`: a weight file against the engine's tensor specs, before anything loads.
- `nccl`: the NCCL transfer's request models and its update vetting (no I/O).
- `manager`: `WeightsManager`, what the routes call: the version check, the pause,
  install, persist and restore.

The dtype table both sides of the wire read is `trainer_client.contract.dtypes`: a
trainer imports no server module. Nothing here imports the engines: they (one engine,
or a fleet of them: `sampler_service.fleet`) satisfy `WeightTarget` as they are.
"""
