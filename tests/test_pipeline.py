"""Pipeline, tensor and composed parallelism on real gloo process groups, each compared to one process.
The CPU is the subject: ranks are CPU ranks on gloo on any machine (`cpu_ranks`, conftest.py)."""
import itertools, logging, warnings
import pytest
import torch
import torch.distributed as dist
from torch import nn
import torch.distributed.pipelining, torch.distributed.tensor.parallel, torch.distributed.fsdp  # once, before forking
from dtnb.launcher.processes import launch, LaunchError
from dtnb.core.models import ToyModel, Block, TinyTransformer, toy_data, toy_sequences
from dtnb.parallel.pipeline_split import split_model, pipeline_units, balance_bounds
from dtnb.parallel.pipeline_schedules import schedule_order, simulate_schedule, bubble_fraction, SCHEDULES
from dtnb.parallel.pipeline import apply_pipeline, Pipeline
from dtnb.parallel.tensor import tp_plan, apply_tp
from dtnb.parallel.parallelize import Degrees, parallelize, data_rank
from dtnb.core.utils import torch_version, TORCH_NEEDS

def too_old(feature):
    "Whether this torch is older than `feature` needs (dtnb then refuses it, naming the version: tested so)"
    return feature in TORCH_NEEDS and torch_version() < TORCH_NEEDS[feature][0]

def refused(feature, fn, *args, **kw):
    "On a torch too old for `feature`: the launch stops with the version it needs"
    v = '.'.join(map(str, TORCH_NEEDS[feature][0]))
    with pytest.raises(LaunchError, match=f"{feature} needs torch >= {v}"): launch(fn, *args, **kw)

pytestmark = pytest.mark.usefixtures('cpu_ranks')

mse = nn.functional.mse_loss


# ---------------------------------------------------------------- models and references
def uneven_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), Block(32, 256), Block(32, 256), *[Block(32, 32) for _ in range(6)],
                         nn.Linear(32, 4))

def seqs(): return toy_sequences(64, seq=8)
def full(t): return t.full_tensor() if hasattr(t, 'full_tensor') else t

def reference(make=ToyModel, data=lambda: toy_data(64), steps=3, batch=16):
    "One process, SGD: losses per step, first-step gradients, final parameters"
    model, ds = make(), data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], None
    for i in range(steps):
        x, y = ds[i * batch:(i + 1) * batch]
        loss = mse(model(x), y)
        opt.zero_grad(); loss.backward()
        grads = grads or {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step(); losses.append(loss.item())
    return losses, grads, {k: v.clone() for k, v in model.state_dict().items()}

REF = {}
def ref(make=ToyModel, data=lambda: toy_data(64)):
    key = (make, data.__name__ if hasattr(data, '__name__') else id(data))
    if key not in REF: REF[key] = reference(make, data)
    return REF[key]

def assert_close(a, b, eps=1e-6, what=''):
    d = (torch.as_tensor(a) - torch.as_tensor(b)).abs().max().item()
    assert d <= eps, f"{what}: max difference {d:.3g} > {eps}"

def merged(res, key): return {k: v for r in res for k, v in r[key].items()}


# ---------------------------------------------------------------- pipeline parallel
def train_pipe(schedule, make=ToyModel, data=lambda: toy_data(64), steps=3, batch=16, **kw):
    model, ds = make(), data()
    pipe = apply_pipeline(model, mse, schedule=schedule, example=ds[:4][0], **kw)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    losses, grads = [], None
    for i in range(steps):
        x, y = ds[i * batch:(i + 1) * batch]
        opt.zero_grad()
        losses.append(pipe.step(x, y).item())
        grads = grads or {k: p.grad.clone() for k, p in pipe.named_parameters()}
        opt.step()
    return dict(losses=losses, grads=grads, params=pipe.state_dict(), stages=pipe.stage_indices)

@pytest.mark.parametrize('schedule', list(SCHEDULES))
def test_schedule_equals_one_process(schedule):
    "2 ranks (one or two stages each): loss on every rank equal, gradients and parameters after 3 steps to 1e-6"
    if too_old(schedule): return refused(schedule, train_pipe, schedule, nprocs=2)
    res = launch(train_pipe, schedule, nprocs=2)
    losses, grads, params = ref()
    for r in res: assert_close(r['losses'], losses, what='loss')
    g, p = merged(res, 'grads'), merged(res, 'params')
    assert sorted(g) == sorted(grads) and sorted(p) == sorted(params)
    for k in grads: assert_close(g[k], grads[k], what=k)
    for k in params: assert_close(p[k], params[k], what=k)
    assert res[0]['stages'] == ([0] if SCHEDULES[schedule][1] == 'one' else [0,
        3] if 'V' in SCHEDULES[schedule][1] else [0, 2])

def test_interleaved_two_stages_per_rank_more_microbatches():
    res = launch(train_pipe, 'interleaved1f1b', n_microbatches=8, nprocs=2)
    assert [r['stages'] for r in res] == [[0, 2], [1, 3]]
    losses, grads, _ = ref()
    g = merged(res, 'grads')
    for k in grads: assert_close(g[k], grads[k], what=k)

def test_balanced_split_on_uneven_layers():
    "Balancing by parameters reaches the best possible largest stage; an equal-count split does not"
    m = uneven_model()
    units = pipeline_units(m)
    costs = [float(sum(p.numel() for p in m.get_submodule(u).parameters())) for u in units]
    for k in (2, 3, 4):
        s = split_model(m, n_stages=k)
        best = min(max(sum(costs[a:b]) for a, b in zip((0,) + c, c + (len(costs),
                                                                      ))) for c in itertools.combinations(range(1,
                                                                          len(costs)), k - 1))
        assert max(s.stage_costs) == best
    assert split_model(m, n_stages=2).imbalance < 1.3 < split_model(m, split_points=['5']).imbalance

def test_balanced_uneven_model_trains_like_one_process():
    res = launch(train_pipe, '1f1b', make=uneven_model, nprocs=2)
    losses, grads, _ = ref(uneven_model)
    assert set(res[0]['params']) == {k for k in grads if k.startswith(('0.',
        '1.'))}  # stage 0: input layer and first wide block
    for r in res: assert_close(r['losses'], losses, what='loss')
    g = merged(res, 'grads')
    for k in grads: assert_close(g[k], grads[k], what=k)

def test_balance_bounds_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        costs = torch.randint(0, 10, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
        for k in range(1, len(costs) + 1):
            b = balance_bounds(costs, k)
            assert all(lo < hi for lo, hi in zip(b, b[1:]))
            cuts = itertools.combinations(range(1, len(costs)), k - 1)
            best = min(max(sum(costs[lo:hi]) for lo, hi in zip((0,) + c, c + (len(costs),))) for c in cuts)
            assert max(sum(costs[lo:hi]) for lo, hi in zip(b, b[1:])) == best

def profile(schedule, m=4):
    pipe = apply_pipeline(ToyModel(), mse, schedule=schedule, n_microbatches=m)
    x, y = toy_data(64)[:16]
    pipe.step(x, y)
    return pipe.profile_step(x, y), pipe.order()

@pytest.mark.parametrize('schedule', ['gpipe', '1f1b', 'interleaved1f1b', 'zbvzerobubble'])
def test_measured_order_is_the_plan(schedule):
    "What each rank ran, in time order, is the order the schedule plans (for 1F1B/GPipe: dtnb's own derivation)"
    if too_old(schedule): return refused(schedule, profile, schedule, nprocs=2)
    if schedule == 'interleaved1f1b' and torch_version() < (2, 11):
        pytest.skip("torch 2.10 runs interleaved 1F1B's actions in another order than its later releases, which "
                    "dtnb's plan shows")
    tl, order = launch(profile, schedule, nprocs=2)[0]
    for r in range(2):
        events = sorted(tl.events, key=lambda e: e['start'])
        assert [(e['stage'], e['kind'], e['mb']) for e in events if e['rank'] == r] == order[r]
    assert 0 <= tl.bubble < 1 and tl.span > 0 and tl.loss > 0

@pytest.mark.parametrize('p,m', list(itertools.product((1, 2, 4, 6), (1, 3, 8))))
def test_simulated_bubble_is_the_formula(p, m):
    for s in ('gpipe', '1f1b'):
        assert abs(simulate_schedule(schedule_order(s, p, m), s).bubble - bubble_fraction(p, m)) < 1e-9
    assert simulate_schedule(schedule_order('gpipe', p, m)).peak_in_flight == m
    assert simulate_schedule(schedule_order('1f1b', p, m)).peak_in_flight == min(p, m)

def loop_api(degrees, schedule):
    quiet()
    deg = Degrees(**degrees)
    mesh = deg.build_mesh()
    pipe = parallelize(ToyModel(), deg, mse, mesh=mesh, schedule=schedule)
    (r, n), (x, y) = data_rank(mesh), toy_data(64)[:16]
    x, y = x[r * 16 // n:(r + 1) * 16 // n], y[r * 16 // n:(r + 1) * 16 // n]
    pipe.zero_grad(); pipe.step(x, y)
    norm = pipe.clip_grad_norm_(0.5).item()
    grads = {k: full(p.grad).clone() for k, p in pipe.named_parameters()}
    val = pipe.eval().eval_loss(x, y).item()
    return norm, grads, val

@pytest.mark.parametrize('degrees,schedule', [(dict(pp=2), '1f1b'), (dict(pp=2), 'interleaved1f1b'), (dict(pp=2, tp=2),
                                                                                                      'gpipe'),
                                              (dict(pp=2, dp_shard=2), '1f1b')])
def test_clip_and_eval_over_all_stages(degrees, schedule):
    "The clipping norm is the whole model's, the clipped gradients and the forward-only loss are one process's"
    model = ToyModel(); x, y = toy_data(64)[:16]
    loss = mse(model(x), y); loss.backward()
    norm = nn.utils.clip_grad_norm_(model.parameters(), 0.5).item()
    res = launch(loop_api, degrees, schedule, nprocs=2 * len(degrees))
    for n, _, v in res: assert_close(n, norm, 1e-5, 'norm'); assert_close(v, loss.item(), what='eval loss')
    g = {k: v for _, gr, _ in res for k, v in gr.items()}
    for k, p in model.named_parameters(): assert_close(g[k], p.grad, what=k)

def v_eval():
    pipe = apply_pipeline(ToyModel(), mse, schedule='zbvzerobubble')
    pipe.eval_loss(*toy_data(64)[:16])

def test_v_schedules_refuse_eval():
    if too_old('zbvzerobubble'): return refused('zbvzerobubble', v_eval, nprocs=2, timeout=60)
    with pytest.raises(LaunchError, match="cannot run forward only"): launch(v_eval, nprocs=2, timeout=60)

def odd_batch():
    apply_pipeline(ToyModel(), mse, n_microbatches=4).step(*toy_data(64)[:10])
def too_many_stages(): apply_pipeline(ToyModel(depth=1), mse, schedule='interleaved1f1b')
def wrong_count(): apply_pipeline(ToyModel(), mse, n_stages=3)

@pytest.mark.parametrize('fn,msg', [
    (odd_batch,
     "a batch of 10 does not split into n_microbatches=4 equal microbatches: use a batch size that is a multiple of 4 "
     "(e.g. 12)"),
    (too_many_stages, "n_stages=4 but ToyModel has only 3 pipeline units (inp, layers.0, head): use n_stages <= 3"),
    (wrong_count, "schedule '1f1b' runs one stage per rank: n_stages=3 on 2 pipeline ranks; use n_stages=2"),
])
def test_pipeline_errors_name_the_numbers(fn, msg):
    with pytest.raises(LaunchError, match=None) as e: launch(fn, nprocs=2, timeout=60)
    assert msg in str(e.value)


# ---------------------------------------------------------------- tensor parallel and composition
def quiet():
    logging.getLogger('torch.distributed.tensor._redistribute').setLevel(logging.ERROR)
    warnings.filterwarnings('ignore', message='FSDP2-wrapped module')

def tp_train(make, data, sp):
    from torch.distributed.device_mesh import init_device_mesh
    quiet()
    model, ds = make(), data()
    apply_tp(model, init_device_mesh('cpu', (2,), mesh_dim_names=('tp',)), sequence_parallel=sp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for i in range(3):
        x, y = ds[i * 16:(i + 1) * 16]
        loss = mse(model(x), y); opt.zero_grad(); loss.backward(); opt.step(); losses.append(loss.item())
    return losses, {k: full(v).clone() for k, v in model.state_dict().items()}

@pytest.mark.parametrize('make,data,sp', [(ToyModel, lambda: toy_data(64), False), (TinyTransformer, seqs, False),
                                          (TinyTransformer, seqs, True)])
def test_tensor_parallel_equals_one_process(make, data, sp):
    losses, _, params = ref(make, data)
    for l, p in launch(tp_train, make, data, sp, nprocs=2):
        assert_close(l, losses, what='loss')
        for k in params: assert_close(p[k], params[k], what=k)

def train(degrees, make=ToyModel, data=lambda: toy_data(64), steps=3, batch=16, **kw):
    quiet()
    deg = Degrees(**degrees)
    mesh = deg.build_mesh()
    model = parallelize(make(), deg, mse, mesh=mesh, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ds, (r, n) = data(), data_rank(mesh)
    losses = []
    for i in range(steps):
        x, y = (t[r * batch // n:(r + 1) * batch // n] for t in ds[i * batch:(i + 1) * batch])
        opt.zero_grad()
        if isinstance(model, Pipeline): loss = model.step(x, y)
        else:
            loss = mse(model(x), y); loss.backward()
            loss = loss.detach().clone(); dist.all_reduce(loss); loss /= dist.get_world_size()
        opt.step(); losses.append(loss.item())
    sd = model.state_dict() if isinstance(model, Pipeline) else getattr(model, 'module', model).state_dict()
    return losses, {k: full(v).detach().clone() for k, v in sd.items()}

COMBOS = [  # degrees, parallelize options, ranks, transformer?
    (dict(dp_shard=2, tp=2), {}, 4, False),                      # 2-D FSDP × TP
    (dict(dp_replicate=2, tp=2), {}, 4, False),                  # DDP (replicate) × TP
    (dict(dp_replicate=2, dp_shard=2), {}, 4, False),            # HSDP
    (dict(dp_replicate=2), {}, 2, False),                        # plain DDP
    (dict(pp=2, dp_replicate=2), {}, 4, False),                  # PP × DDP
    (dict(pp=2, dp_replicate=2), dict(schedule='gpipe', activation_checkpointing=True), 4, False),
    (dict(pp=2, dp_replicate=2), dict(schedule='interleaved1f1b'), 4, False),
    (dict(pp=2, dp_shard=2), dict(activation_checkpointing=True), 4, False),   # PP × FSDP
    (dict(pp=2, tp=2), {}, 4, False),                            # PP × TP
    (dict(pp=2, tp=2), dict(sequence_parallel=True, activation_checkpointing=True), 4, True),
    (dict(dp_shard=2, tp=2), dict(sequence_parallel=True, activation_checkpointing=True), 4, True),
]

@pytest.mark.parametrize('degrees,kw,n,transformer', COMBOS,
                         ids=[f"{'x'.join(f'{k}{v}' for k, v in d.items())}-{'-'.join(kw) or 'plain'}" for d, kw, _,
                              _ in COMBOS])
def test_composition_equals_one_process(degrees, kw, n, transformer):
    make, data = (TinyTransformer, seqs) if transformer else (ToyModel, lambda: toy_data(64))
    losses, _, params = ref(make, data)
    if kw.get('sequence_parallel') and 'pp' in degrees and too_old('sequence parallel in a pipeline'):
        return refused('sequence parallel in a pipeline', train, degrees, make, data, **kw, nprocs=n)
    res = launch(train, degrees, make, data, **kw, nprocs=n)
    for l, _ in res: assert_close(l, losses, what='loss')
    p = {k: v for _, ps in res for k, v in ps.items()}
    assert sorted(p) == sorted(params)
    for k in params: assert_close(p[k], params[k], what=k)

def test_recommended_layout_trains_like_one_process():
    "recommend(..., world_size=4, layouts=True) on devices too small for DDP: parallelize(plan.degrees) is one process"
    from dataclasses import asdict
    from dtnb.plan.memory import estimate_memory, TransformerShape
    from dtnb.plan.recommend import recommend
    xy = seqs()[:4]  # one rank's share of a step's 16 sequences when 4 ranks split the data
    kw = dict(batch=xy, loss_fn=mse, optimizer='sgd', precision='fp32')
    ddp = estimate_memory(TinyTransformer(), degrees=Degrees(dp_replicate=4), **kw)
    shape = TransformerShape(layers=2, hidden=32, heads=4, seq_len=8, batch=4)  # TinyTransformer's: ranks by step time
    plan = recommend(TinyTransformer(), **kw, world_size=4, memory=ddp.total, layouts=True, shape=shape)
    e = plan.estimates[plan.chosen]
    assert plan.degrees.world_size == 4 and e.total <= plan.budget < ddp.total and plan.degrees.dp_replicate < 4, plan
    assert plan.reason.startswith('the fastest (predicted)'), plan.reason
    losses, _, params = ref(TinyTransformer, seqs)
    ac = e.activation_checkpointing
    res = launch(train, asdict(plan.degrees), TinyTransformer, seqs, activation_checkpointing=ac, nprocs=4)
    for l, _ in res: assert_close(l, losses, what='loss')
    p = {k: v for _, ps in res for k, v in ps.items()}
    assert sorted(p) == sorted(params)
    for k in params: assert_close(p[k], params[k], what=k)

def test_degrees_product_error():
    with pytest.raises(LaunchError) as e: launch(train, dict(dp_shard=2, tp=2), nprocs=2, timeout=60)
    assert ("dp_replicate 1 × dp_shard 2 × tp 2 × pp 1 = 4, but the world size is 2: make the product equal 2 "
            "(e.g. dp_shard=1)") in str(e.value)
    with pytest.raises(ValueError, match="tp=-1 takes what the other degrees leave, but they need 3 ranks"):
        Degrees(dp_shard=3, tp=-1).resolve(4)

def mesh_groups():
    mesh = Degrees(pp=2, tp=2).build_mesh()
    return {k: dist.get_process_group_ranks(mesh[k].get_group()) for k in ('pp', 'tp')}, data_rank(mesh)

def test_mesh_is_named_and_tp_innermost():
    res = launch(mesh_groups, nprocs=4)
    assert [r[0]['tp'] for r in res] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r[0]['pp'] for r in res] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all(r[1] == (0, 1) for r in res)  # one data shard: every rank loads the same batches


# ---------------------------------------------------------------- the training loop
def fit_pipe(degrees, dicts=False):
    from torch.utils.data import DataLoader
    from dtnb.train.loop import fit
    quiet()
    deg = Degrees(**degrees)
    mesh = deg.build_mesh()
    model = parallelize(ToyModel(), deg, mse, mesh=mesh)
    r, n = data_rank(mesh)
    x, y = toy_data(64)[:48]
    ds = torch.utils.data.TensorDataset(*(t.view(3, n, 16 // n, -1)[:, r].reshape(-1, t.shape[-1]) for t in (x,
        y)))  # this rank's share
    kw = dict(keys=('inputs', 'targets')) if dicts else {}
    if dicts: ds = [dict(inputs=a, targets=b) for a, b in ds]  # dict batches: fit cuts them by `keys`
    xv, yv = toy_data(32, seed=1)[:]  # validated at the end of the epoch: this replica's half (or all) of 32
    val = torch.utils.data.TensorDataset(*(t.view(2, n, 16 // n, -1)[:, r].reshape(-1, t.shape[-1]) for t in (xv, yv)))
    if dicts: val = [dict(inputs=a, targets=b) for a, b in val]
    res = fit(model, DataLoader(ds, batch_size=16 // n), torch.optim.SGD(model.parameters(), lr=0.1), progress=False,
              val_loader=DataLoader(val, batch_size=16 // n), **kw)
    return (res.losses, res.samples, {k: full(v).detach().clone() for k, v in model.state_dict().items()},
            model.data_parallel_size, [v['val_loss'] for v in res.validations])

@pytest.mark.parametrize('degrees,dicts', [(dict(pp=2), False), (dict(pp=2), True), (dict(pp=2, dp_replicate=2),
                                                                                     False)])
def test_fit_trains_a_pipeline_like_one_process(degrees, dicts):
    losses, _, params = ref()
    res = launch(fit_pipe, degrees, dicts, nprocs=2 * len(degrees))
    one = ToyModel(); one.load_state_dict(params)
    xv, yv = toy_data(32, seed=1)[:]
    with torch.no_grad(): val = mse(one(xv), yv).item()  # the trained model of one process, on the whole set
    for l, samples, _, dp, vals in res:
        assert_close(l, losses, what='loss'); assert samples == 48 and dp == degrees.get('dp_replicate', 1)
        assert_close(vals, [val], what='val_loss')  # every rank, every stage
    p = {k: v for _, _, ps, _, _ in res for k, v in ps.items()}
    for k in params: assert_close(p[k], params[k], what=k)
