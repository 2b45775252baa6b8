"""The parent's typed view of what the numerics probe (sandbox/numerics_probe.py) reported."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from trainbridge.sandbox.results import RunResult


class ProbeReportError(ValueError):
    """A numerics run succeeded but returned no usable probe report."""


class ProbeReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    seed: int
    batch_indices: list[int]
    grads_path: Path = Field(description="torch.save'd dict: parameter name -> first-step gradient (CPU)")
    grads_sha256: str | None = Field(default=None, description="the SHA-256 of that file's bytes, as the child reported it "
                                     "over its own channel (sandbox/evidence.py)")
    param_names: list[str] = Field(description="model.named_parameters() order")
    param_shapes: dict[str, list[int]]
    trainable: list[str] = Field(description="parameters with requires_grad")
    no_grad_params: list[str] = Field(description="trainable parameters that got no gradient from loss_fn")
    grad_loss: float = Field(description="loss_fn value on the first batch (forward only)")
    losses: list[float] = Field(description="train_step losses on the batches, in order")
    batch_hashes: list[str | None] = Field(description="content hash of batch(i) per index; None when not hashable")
    batch_repeatable: bool = Field(description="batch(i) gave the same content twice")
    batch_mutated_by_step: list[bool]
    unchanged_params: list[list[str]] = Field(description="per step: trainable parameters whose bits the step left unchanged")
    same_loss_object: list[bool] = Field(description="per step: train_step returned an object it had returned before")
    compiled: bool = False
    random_aligned: str | None = Field(default=None, description="how random ops were aligned with the baseline's when "
                                       "they mattered (sandbox/random_alignment.py), e.g. 'inductor_fallback_random'")

    @classmethod
    def from_run(cls, result: RunResult) -> "ProbeReport":
        """The report inside a successful numerics run; raises ProbeReportError otherwise."""
        payload = result.extra.get("numerics")
        if not isinstance(payload, dict):
            raise ProbeReportError(
                "the numerics run returned no probe report: the harness has no 'numerics' mode or the run "
                "failed before the probe finished (see the run's stderr tail)"
            )
        return cls.model_validate(payload)
