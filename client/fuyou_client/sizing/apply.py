"""``attach(model, plan=...)``: a plan's settings as attach's options and optimizer.

``plan`` is a ``Plan`` (``fuyou_client.plan(...)``) or ``"auto"``: plan now for the model
being attached (counted on it, the meta device is enough) and this host as the daemon
sees it (its session budget and optimizer buffer budget from its Status; its devices'
directories measured; memory and the GPU probed). Options given beside the plan win and
are named in the log line; an optimizer whose state dtype differs from the plan's is
refused (the plan's memory and SSD figures are for its dtype), and so is a 16-bit model in
another dtype than the plan's GPU computed in (its time is for that dtype)."""
from __future__ import annotations

import logging
from pathlib import Path

from fuyou_client.sizing import host as make_host
from fuyou_client.sizing import model_compute
from fuyou_client.sizing.hardware import TORCH_DTYPE
from fuyou_client.sizing.plan_search import Plan, search
from fuyou_client.sizing.shape import from_model

log = logging.getLogger("fuyou_client")


def plan_for(model, socket: str | None = None, session=None, seq: int | None = None) -> Plan:
    """The "auto" plan: this model on this host, budgets from the daemon."""
    from fuyou_client.connection.session import connect
    from fuyou_client.sizing import DEFAULT_SEQ, TOKENS_PER_STEP

    shape = from_model(model)
    own = session is None
    s = session or connect(socket)
    try:
        st = s.status()
    finally:
        if own:
            s.close()
    dirs = sorted({str(Path(d.path).parent) for d in st.devices}) or None
    where = make_host(data_dirs=dirs, pinned_budget=st.session_budget_bytes or st.pinned_budget_bytes or None,
                      buffer_budget=st.optimizer_buffer_budget_bytes or None)
    return search(shape, where, seq or min(DEFAULT_SEQ, shape.max_seq or DEFAULT_SEQ), TOKENS_PER_STEP,
                  compute=model_compute(model) or "bf16")


def apply(plan, model, optimizer, options: dict) -> tuple[dict, object, Plan]:
    """(options with the plan's filled in, the optimizer, the plan)."""
    from fuyou_client.optim import AdamW

    if isinstance(plan, str):
        if plan != "auto":
            raise ValueError(f"plan must be a fuyou_client.plan(...) result or 'auto', not {plan!r}")
        plan = plan_for(model, options.get("socket"), options.get("session"))
    if not isinstance(plan, Plan):
        raise ValueError(f"plan must be a fuyou_client.plan(...) result or 'auto', not {type(plan).__name__}")
    if not plan.fits:
        raise ValueError(f"the plan has no settings that fit: {plan.minimums_text()}")
    s = plan.settings
    chosen = s.attach_options()
    kept = {k: options[k] for k in chosen if k in options and options[k] != chosen[k]}
    merged = chosen | options
    if optimizer is None:
        optimizer = AdamW(state_dtype=s.state_dtype)
    elif getattr(optimizer, "state_dtype", s.state_dtype) != s.state_dtype:
        raise ValueError(f"the plan chose {s.state_dtype} optimizer state and the optimizer given keeps "
                         f"{optimizer.state_dtype}: pass AdamW(state_dtype={s.state_dtype!r}, ...) or plan with "
                         f"state_dtype={optimizer.state_dtype!r}")
    own = model_compute(model)
    if plan.host.gpu is not None and own is not None and own != s.compute:
        raise ValueError(f"the plan's GPU computes in {s.model_dtype(plan.host)} and the model is in "
                         f"{TORCH_DTYPE[own]}: attach computes in the model's "
                         f"dtype; plan with compute={own!r}, or convert the model")
    log.info("attach: plan %s; options %s%s", ", ".join(f"{k}={v!r}" for k, v in chosen.items()) or "defaults",
             ", ".join(f"{k}={v!r}" for k, v in merged.items()),
             f" (given beside the plan, kept: {', '.join(kept)})" if kept else "")
    log.info("attach: the plan's training shape: %d x %d tokens per micro-batch, %d micro-batches per step (%s)",
             s.micro_batch, s.seq, s.micro_batches,
             "engine.train_step" if s.schedule == "block-major" else "the ordinary loop")
    return merged, optimizer, plan
