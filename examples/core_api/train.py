"""A Core API example with no framework: fit y = w*x by gradient descent on synthetic data.

Written against Determined's API (``import determined as det``) to show that such scripts run
unchanged under detslurm. It reports training and validation metrics, checkpoints, resumes
from the latest checkpoint after a pause/restart, and honours preemption (pause, early stop).
"""

import json
import logging
import os
import random
import sys
import time

import determined as det

TOTAL_BATCHES = int(os.environ.get("EXAMPLE_TOTAL_BATCHES", "40"))


def load_state(ctx, latest, trial_id):
    if latest is None:
        return 0.0, 0
    with ctx.checkpoint.restore_path(latest) as path:
        state = json.loads((path / "state.json").read_text())
    # A warm start from another trial keeps the weights but restarts the batch count.
    return state["w"], state["batch"] if state["trial_id"] == trial_id else 0


def main(ctx):
    info = det.get_cluster_info()
    hparams = info.trial.hparams if info else {"lr": 0.05, "noise": 0.1, "sleep": 0.0}
    trial_id = info.trial.trial_id if info else 0
    w, batch = load_state(ctx, info.latest_checkpoint if info else None, trial_id)
    rng = random.Random(1234 + batch)
    true_w = 3.0
    crash_at = int(os.environ.get("EXAMPLE_CRASH_AT_BATCH", "-1"))
    while batch < TOTAL_BATCHES:
        x = rng.uniform(-1, 1)
        y = true_w * x + rng.gauss(0, hparams["noise"])
        grad = 2 * (w * x - y) * x
        w -= hparams["lr"] * grad
        batch += 1
        time.sleep(float(hparams.get("sleep", 0.0)))
        ctx.train.report_training_metrics(steps_completed=batch, metrics={"loss": (w * x - y) ** 2})
        if batch == crash_at and (info is None or info.trial._trial_run_id == 1):
            print(f"simulated crash at batch {batch}", flush=True)
            os._exit(3)
        if batch % 5 == 0:
            val = (w - true_w) ** 2 + hparams["noise"] ** 2
            ctx.train.report_validation_metrics(
                steps_completed=batch, metrics={"validation_loss": val, "batches": batch}
            )
            with ctx.checkpoint.store_path({"steps_completed": batch}) as (path, _uuid):
                (path / "state.json").write_text(json.dumps({"w": w, "batch": batch, "trial_id": trial_id}))
            ctx.train.report_progress(batch / TOTAL_BATCHES)
            if ctx.preempt.should_preempt():
                print(f"preempted at batch {batch}; exiting after the checkpoint", flush=True)
                return
    print(f"done: w={w:.4f} after {batch} batches", flush=True)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format=det.LOG_FORMAT)
    with det.core.init() as core_context:
        main(core_context)
    sys.exit(0)
