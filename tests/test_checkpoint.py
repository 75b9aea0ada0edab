"""Checkpoints under torchrun restarts, pipeline-style stages, and loaders with workers.

The fault test kills a rank with SIGKILL under `dtnb launch --max-restarts=1` and checks that the finished run is
bitwise the uninterrupted one. Every test checks real files written by real processes; nothing is mocked."""
import copy, json, os, subprocess, sys
from pathlib import Path
import pytest, torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
DTNB = str(Path(PY).parent / 'dtnb')
ENV = {**os.environ, 'PYTHONPATH': os.pathsep.join([str(ROOT), os.environ.get('PYTHONPATH', '')])}
SCRIPT = 'tests/scripts/train_ckpt.py'


def _run(args, timeout=240):
    r = subprocess.run([DTNB, 'launch', '-n', '2', *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads([l for l in r.stdout.splitlines() if l.startswith('{')][-1]), r.stdout + r.stderr


def test_sigkill_restart_resumes_bitwise(tmp_path):
    "One rank SIGKILLs itself at step 7 of 12; torchrun restarts the group; fit resumes at 6; the end equals a clean run"
    from dtnb.checkpoint import load_exported, list_checkpoints
    ref, _ = _run([SCRIPT, '--dir', str(tmp_path / 'ref'), '--out', str(tmp_path / 'ref.pt')])
    got, log = _run(['--max-restarts=1', SCRIPT, '--dir', str(tmp_path / 'ck'), '--out', str(tmp_path / 'got.pt'), '--kill-at', '7'])
    assert 'rank 1: SIGKILL at step 7' in log
    assert (ref['attempt'], ref['start_step']) == (0, 0)
    assert (got['attempt'], got['start_step'], got['steps']) == (1, 6, 12)
    assert got['resumed_from'].endswith('step_00000006')
    assert got['losses'] == ref['losses']  # all 12, the first 6 from the checkpoint
    a, b = load_exported(tmp_path / 'ref.pt'), load_exported(tmp_path / 'got.pt')
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert [c['step'] for c in list_checkpoints(tmp_path / 'ck').complete] == [9, 12]


class Stages:
    "What a pipeline rank holds: stage modules under the original model's parameter names (its `.modules` list)"
    def __init__(self, modules): self.modules = modules
    def parameters(self): return [p for m in self.modules for p in m.parameters()]


UNITS = ['inp', 'layers.0', 'layers.1', 'layers.2', 'layers.3', 'head']


def stage(model, keep):
    "A copy of `model` holding only the units in `keep` (the others replaced by parameter-free modules)"
    m = copy.deepcopy(model)
    for u in UNITS:
        if u in keep: continue
        if u.startswith('layers.'): m.layers[int(u.split('.')[1])] = nn.Identity()
        else: setattr(m, u, nn.Identity())
    return m


def _stages_of(split, r):
    from dtnb.models import ToyModel
    full = ToyModel()
    return Stages([stage(full, units) for units in split[r]])


INTERLEAVED = {0: [['inp', 'layers.0'], ['layers.2']], 1: [['layers.1'], ['layers.3', 'head']]}  # two stages per rank
CONTIGUOUS = {0: [['inp', 'layers.0', 'layers.1']], 1: [['layers.2', 'layers.3', 'head']]}    # one stage per rank


def _train_stages(ckdir, out):
    from dtnb.launch import rank
    from dtnb.checkpoint import save_checkpoint, export_model
    torch.manual_seed(rank())
    pipe = _stages_of(INTERLEAVED, rank())
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    for _ in range(2):  # stand-in for a pipeline step: each rank updates its own stages
        opt.zero_grad(); sum((p * torch.randn_like(p)).sum() for p in pipe.parameters()).backward(); opt.step()
    save_checkpoint(Path(ckdir) / 'step_00000002', pipe, opt, step=2)
    export_model(out, pipe)
    mine = {k: v.detach().clone() for m in pipe.modules for k, v in m.state_dict().items()}
    state = {f"{n}.{k}": v.clone() for m in pipe.modules for n, p in m.named_parameters() for k, v in opt.state[p].items()}
    return mine, state


def _load_contiguous(ckdir):
    from dtnb.launch import rank
    from dtnb.checkpoint import load_checkpoint
    pipe = _stages_of(CONTIGUOUS, rank())
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    load_checkpoint(ckdir, pipe, opt)
    mine = {k: v.detach().clone() for m in pipe.modules for k, v in m.state_dict().items()}
    state = {f"{n}.{k}": v.clone() for m in pipe.modules for n, p in m.named_parameters() for k, v in opt.state[p].items()}
    return mine, state


def test_pipeline_stages_save_and_load_in_any_split(tmp_path):
    "Stages held two per rank save under the model's names; they load on one process, in another split, and export whole"
    from dtnb.launch import launch
    from dtnb.models import ToyModel
    from dtnb.checkpoint import load_checkpoint, load_exported
    saved = launch(_train_stages, str(tmp_path / 'ck'), tmp_path / 'model.safetensors', nprocs=2)
    params = {k: v for p, _ in saved for k, v in p.items()}
    state = {k: v for _, s in saved for k, v in s.items()}
    assert set(params) == set(ToyModel().state_dict())  # the two ranks together hold the whole model, once
    # one process, the whole model
    model = ToyModel(seed=7)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ck = load_checkpoint(tmp_path / 'ck', model, opt)
    assert (ck.step, ck.saved_ranks) == (2, 2)
    assert all(torch.equal(model.state_dict()[k], params[k]) for k in params)
    got = {f"{n}.{k}": v for n, p in model.named_parameters() for k, v in opt.state[p].items()}
    assert set(got) == set(state) and all(torch.equal(got[k], state[k]) for k in state)
    # two ranks, cut elsewhere, one stage each
    other = launch(_load_contiguous, str(tmp_path / 'ck'), nprocs=2)
    assert all(torch.equal(v, params[k]) for p, _ in other for k, v in p.items())
    assert all(torch.equal(v, state[k]) for _, s in other for k, v in s.items())
    # the exported file is the whole model
    sd = load_exported(tmp_path / 'model.safetensors', ToyModel(seed=3))
    assert set(sd) == set(params) and all(torch.equal(sd[k], params[k]) for k in params)


def test_resume_with_loader_workers_and_own_generator():
    "A shuffled DataLoader with 2 workers and its own generator resumes mid-epoch on the same batches"
    from torch.utils.data import DataLoader, TensorDataset
    from dtnb.checkpoint import resumable, rng_state, set_rng_state
    ds = TensorDataset(torch.arange(40))
    def make(): return resumable(DataLoader(ds, batch_size=4, shuffle=True, num_workers=2, generator=torch.Generator().manual_seed(1)))
    a = make()
    it = iter(a)
    head = [next(it)[0].tolist() for _ in range(4)]
    pos, rng = a.state_dict(), rng_state()
    straight = [b[0].tolist() for b in it] + [b[0].tolist() for b in a]
    b = make()
    b.load_state_dict(pos); set_rng_state(rng)
    resumed = [x[0].tolist() for x in b] + [x[0].tolist() for x in b]
    assert resumed == straight and len(straight) == 6 + 10
    assert sorted(sum(head + straight[:6], [])) == list(range(40))
