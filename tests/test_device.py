"Device detection on this machine, and launcher parsing from explicit environments"
import json, time
import pytest
from dtnb.device import detect, parse_launch_env, LaunchEnvError, capability_features, peak_tflops, expand_nodelist


def test_real_detection_on_this_machine():
    r = detect()
    assert r.devices[0].type == 'cpu' and r.devices[0].cores >= 1
    assert r.backends['gloo'] is True
    assert r.launch.launcher is None and r.launch.world_size == 1
    assert r.in_notebook is False
    assert r.host['ram'] > 2**30 and r.host['usable_cores'] >= 1
    assert r.recommended['backend'] in ('gloo', 'nccl', 'xccl')


@pytest.mark.parametrize('env,expect', [
    (dict(TORCHELASTIC_RUN_ID='j', RANK='3', WORLD_SIZE='4', LOCAL_RANK='1', LOCAL_WORLD_SIZE='2', GROUP_RANK='1',
          MASTER_ADDR='10.0.0.1', MASTER_PORT='29500'), ('torchrun', 3, 4, 1, 2, 1, 2, '10.0.0.1', 29500)),
    (dict(SLURM_PROCID='7', SLURM_NTASKS='8', SLURM_LOCALID='3', SLURM_NODEID='1', SLURM_NNODES='2',
          SLURM_JOB_NODELIST='node[1-2]', SLURM_NTASKS_PER_NODE='4', SLURM_JOB_ID='100'),
     ('slurm', 7, 8, 3, 4, 1, 2, 'node1', 15100)),
    (dict(OMPI_COMM_WORLD_RANK='1', OMPI_COMM_WORLD_SIZE='2', OMPI_COMM_WORLD_LOCAL_RANK='1', OMPI_COMM_WORLD_LOCAL_SIZE='2',
          MASTER_ADDR='127.0.0.1', MASTER_PORT='1234'), ('openmpi', 1, 2, 1, 2, 0, 1, '127.0.0.1', 1234)),
])
def test_launchers(env, expect):
    l = parse_launch_env(env)
    assert (l.launcher, l.rank, l.world_size, l.local_rank, l.local_world_size, l.node_rank, l.nnodes, l.master_addr, l.master_port) == expect


@pytest.mark.parametrize('nodelist,hosts', [
    ('gpu[01-04,07]', ['gpu01', 'gpu02', 'gpu03', 'gpu04', 'gpu07']),
    ('a1,b[8-10]', ['a1', 'b8', 'b9', 'b10']),
    ('n[001-002]x', ['n001x', 'n002x']),
    ('r[1-2]-g[1,3]', ['r1-g1', 'r1-g3', 'r2-g1', 'r2-g3']),
])
def test_slurm_nodelists(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize('env,msg', [
    (dict(RANK='0', WORLD_SIZE='abc'), "WORLD_SIZE='abc' is not an integer"),
    (dict(RANK='2', WORLD_SIZE='2'), "RANK=2 must be less than WORLD_SIZE=2"),
    (dict(LOCAL_RANK='0'), "WORLD_SIZE is not"),
    (dict(SLURM_PROCID='x', SLURM_NTASKS='2'), "SLURM_PROCID='x' is not an integer"),
    (dict(RANK='0', WORLD_SIZE='2', LOCAL_RANK='3', LOCAL_WORLD_SIZE='2'), "LOCAL_RANK=3 must be less than the local world size 2"),
])
def test_bad_launcher_variables(env, msg):
    with pytest.raises(LaunchEnvError, match=msg.replace('(', r'\(').replace('[', r'\[')):
        parse_launch_env(env)


@pytest.mark.parametrize('cc,bf16,tf32,fp8', [((7, 0), 0, 0, 0), ((8, 0), 1, 1, 0), ((8, 6), 1, 1, 0),
                                              ((8, 9), 1, 1, 1), ((9, 0), 1, 1, 1), ((10, 0), 1, 1, 1)])
def test_capability_features(cc, bf16, tf32, fp8):
    f = capability_features(*cc)
    assert (f['bf16'], f['tf32'], f['fp8']) == (bool(bf16), bool(tf32), bool(fp8))


def test_unknown_gpu_has_unknown_peak():
    assert peak_tflops('NVIDIA Quantum Imaginator 9000') == ({}, None)
    peaks, src = peak_tflops('NVIDIA H100 80GB HBM3')
    assert peaks['bf16'] == 989.4 and 'datasheet' in src


def test_cli_env_json_matches_detect(run_cli):
    r = run_cli('env', '--json')
    d, ref = json.loads(r.stdout), detect().to_dict()
    for k in ('host', 'torch', 'backends', 'launch', 'cuda_initialized', 'p2p', 'nvlink', 'recommended'):
        if k == 'host': d[k].pop('hostname'); ref[k].pop('hostname')
        assert d[k] == ref[k], k
    strip = lambda ds: [{k: v for k, v in x.items() if k != 'free_memory'} for x in ds]  # free memory moves
    assert strip(d['devices']) == strip(ref['devices'])


def test_cli_env_text_is_fast(run_cli):
    t = time.perf_counter()
    r = run_cli('env')
    assert 'recommended' in r.stdout and 'cpu' in r.stdout
    assert time.perf_counter() - t < 10  # the 3 s target is measured in benchmarks/bench_import.py; this guards hangs


def test_cli_env_rejects_bad_launch_env(run_cli):
    r = run_cli('env', env={'RANK': '0', 'WORLD_SIZE': 'abc'}, check=False)
    assert r.returncode == 2 and "dtnb env: error: WORLD_SIZE='abc' is not an integer" in r.stderr
    assert 'Traceback' not in r.stderr
