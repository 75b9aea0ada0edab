"""A collective that outlives its timeout under `dtnb launch` (torchrun) names itself, its line and the ranks that
never came; and `fit` names a rank slower than the others with its cause. CPU ranks on gloo are the subject."""
import os, sys, subprocess, time, textwrap
from pathlib import Path
import pytest
from conftest import cpu_env

ROOT = Path(__file__).resolve().parents[1]
DTNB = str(Path(sys.executable).with_name('dtnb'))
pytestmark = pytest.mark.usefixtures('cpu_ranks')

SKIP = textwrap.dedent('''
    import datetime, torch, torch.distributed as dist, dtnb
    dtnb.init_distributed()
    group = dist.new_group(timeout=datetime.timedelta(seconds=2))  # a short timeout for the test's collectives
    x = torch.ones(3)
    dist.all_reduce(x, group=group)
    if dist.get_rank() != 1:
        dist.all_reduce(x, group=group)  # rank 1 skips this one
    print('rank', dist.get_rank(), 'returned', flush=True)
''')

def test_skipped_all_reduce_under_dtnb_launch_names_rank_and_line(tmp_path):
    script = tmp_path / 'skip.py'; script.write_text(SKIP)
    t = time.monotonic()
    r = subprocess.run([DTNB, 'launch', '-n', '2', str(script)], cwd=ROOT, env=cpu_env(), capture_output=True,
                       text=True, timeout=120)
    took, out = time.monotonic() - t, r.stdout + r.stderr
    assert r.returncode != 0, out
    assert took < 2 + 30, f"took {took:.0f} s"  # the 2 s timeout, start-up and torchrun's stop, not a hang
    summary = out.split('Root Cause (first observed failure)', 1)[-1]  # torchrun's first error holds our message
    for want in ('rank 0 waited', 'in all_reduce at skip.py:8 (`dist.all_reduce(x, group=group)`)',
                 'collective #2 of group 1', 'rank 1 never issued it', 'after 1 collective of that group, it returned'):
        assert want in summary, f"{want!r} not in:\n{out[-3000:]}"


class SlowLoader:
    "Batches of a list, each `delay` seconds late (a slow disk or decoder)"
    def __init__(self, batches, delay): self.batches, self.delay = batches, delay
    def __len__(self): return len(self.batches)
    def __iter__(self):
        for b in self.batches: time.sleep(self.delay); yield b

def busy(seconds):
    "Compute: `seconds` of this thread's CPU time, however busy the machine is"
    end = time.thread_time() + seconds
    while time.thread_time() < end: pass

def two_slow_ranks():
    "fit twice on each rank: a slow loader on rank 1, then extra compute on rank 0; each run's RankSteps"
    import torch, dtnb
    out = []
    for slow_data in (True, False):
        model = dtnb.ToyModel(d=16, depth=1)  # not DDP: its construction imports torch._dynamo, seconds per rank
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = dtnb.toy_data(20 * 8).tensors
        batches = [(x[i:i + 8], y[i:i + 8]) for i in range(0, len(x), 8)]
        loader = SlowLoader(batches, 0.015 if slow_data and dtnb.rank() == 1 else 0)
        def step(m, b):
            if not slow_data and dtnb.rank() == 0: busy(0.015)
            loss = torch.nn.functional.mse_loss(m(b[0]), b[1])
            torch.distributed.all_reduce(loss.detach().clone())  # the ranks meet once a step, as DDP's all-reduce does
            return loss
        r = dtnb.fit(model, loader, opt, step_fn=step, log_every=5, progress=False)
        out.append((r.ranks.straggler, r.ranks.verdict, str(r)))
    return out

def test_fit_names_the_slow_rank_and_its_cause():
    from dtnb import launch
    (data_rank, data_verdict, summary), (busy_rank, busy_verdict, _) = launch(two_slow_ranks, nprocs=2)[0]
    assert data_rank == 1 and 'rank 1 is slower than the others: data wait' in data_verdict, data_verdict
    assert data_verdict in summary  # FitResult's summary says it
    assert busy_rank == 0 and 'rank 0 is slower than the others: compute' in busy_verdict, busy_verdict
