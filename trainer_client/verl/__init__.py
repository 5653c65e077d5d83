"""verl integration: train with verl while the adaptive-rollout sampler does all the rollout.

- verl 0.9 (V1 trainer, TransferQueue): `trainer_client.verl.v1` (an agent-loop manager
  that writes the sampler's groups into TransferQueue and a ``adaptive_rollout`` trainer
  mode that pushes weights back to the sampler), loaded by verl through
  ``VERL_USE_EXTERNAL_MODULES=trainer_client.verl.v1``;
- verl <= 0.8, or 0.9's legacy trainer (DataProto): `trainer_client.verl.v0`
  (`SamplerRayPPOTrainer`, a ``RayPPOTrainer`` whose ``fit`` leases groups, run with
  ``python -m trainer_client.verl.v0 <hydra overrides>``);
- `trainer_client.verl.convert`: groups -> TransferQueue records / DataProto;
- `trainer_client.verl.settings`: the ``trainer.v1.adaptive_rollout`` config section and
  the checks of the sampler's config (group_size == rollout.n, no within-group drops);
- `trainer_client.verl.weights`: weights -> sampler (upload or shared path), also as a verl
  checkpoint-engine backend;
- `trainer_client.verl.pacing`: writes the small placeholder dataset verl's dataloader
  needs to pace steps (the sampler owns the real data).

Importing this package imports neither verl nor torch; its submodules `v1`, `v0` and
`weights` need verl (``pip install 'adaptive-rollout[verl]'``). See docs/verl.md.
"""

from trainer_client.verl.settings import (
    MODE,
    IncompatibleSamplerConfig,
    SamplerSettings,
    check_sampler_config,
    require_compatible,
)

__all__ = [
    "MODE",
    "IncompatibleSamplerConfig",
    "SamplerSettings",
    "check_sampler_config",
    "require_compatible",
]
