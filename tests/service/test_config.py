"""Whole-config checks that protect the sampler from configurations it cannot serve."""

from __future__ import annotations

import pytest

from sampler_service.config import ConfigError, SamplerConfig, check_consistency


def test_frame_larger_than_the_buffer_is_refused() -> None:
    # Admission stops at max_buffered_groups, so this frame could never fill (a silent hang).
    with pytest.raises(ConfigError) as info:
        check_consistency(SamplerConfig(batch_groups=512, max_buffered_groups=256), ["a", "b"])
    assert info.value.field == "batch_groups"
    check_consistency(SamplerConfig(batch_groups=256, max_buffered_groups=256), ["a", "b"])
