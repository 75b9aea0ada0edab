"""`Profiler` under DDP on 2 real gloo ranks: a trace file per rank, and a table that names the all-reduce.
The CPU is the subject: CPU ranks on gloo (`cpu_ranks`, conftest.py)."""
import json, os
import pytest, torch
from dtnb.core.models import ToyModel, toy_data
from dtnb.launcher.processes import launch
from dtnb.parallel.ddp import distributed_loader
from dtnb.parallel.wrap import wrap
from dtnb.train.callbacks import Profiler
from dtnb.train.loop import fit

pytestmark = pytest.mark.usefixtures('cpu_ranks')


def profiled(d):
    torch.manual_seed(0)
    model = wrap(ToyModel(), 'ddp')
    prof = Profiler(d, steps=2)
    fit(model, distributed_loader(toy_data(256), global_batch_size=16), torch.optim.SGD(model.parameters(), lr=0.01),
        max_steps=4, progress=False, callbacks=[prof])
    return prof.table, prof.collective_ms


def test_profiler_on_two_ranks(tmp_path):
    out = launch(profiled, str(tmp_path), nprocs=2)
    assert sorted(os.listdir(tmp_path)) == ['rank0.json', 'rank0.txt', 'rank1.json', 'rank1.txt']
    for r, (table, ms) in enumerate(out):
        events = json.loads((tmp_path / f'rank{r}.json').read_text())['traceEvents']
        assert any(e.get('name') == 'gloo:all_reduce' for e in events)   # the timeline shows the collective
        text = (tmp_path / f'rank{r}.txt').read_text()
        assert 'gloo:all_reduce' in table and ms > 0 and table in text   # and the table counts its time
        assert f"ms in 2 steps (rank {r})" in text
