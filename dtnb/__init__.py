__version__ = "0.1.0"

# The public API, imported on first use so that `import dtnb` stays cheap (heavy torch.distributed
# submodules load only when the feature that needs them runs). Hand-written: nbdev only updates `__version__`.
_API = {
    'detect': 'device', 'DeviceReport': 'device', 'parse_launch_env': 'device', 'LaunchEnv': 'device',
    'ToyModel': 'models', 'toy_data': 'models', 'toy_sequences': 'models',
    'launch': 'launch', 'LaunchError': 'launch', 'init_distributed': 'launch', 'shutdown': 'launch', 'rank': 'launch',
    'world_size': 'launch', 'local_rank': 'launch', 'is_main': 'launch', 'barrier': 'launch', 'rank0_first': 'launch',
    'current_device': 'launch',
    'wrap': 'ddp', 'distributed_loader': 'ddp',
    'fit': 'train', 'FitResult': 'train',
    'estimate_memory': 'memory', 'recommend': 'memory', 'measure_memory': 'memory', 'trace_activations': 'memory',
    'memory_explorer': 'memory', 'TransformerShape': 'memory', 'MemoryEstimate': 'memory', 'MemoryPlan': 'memory',
    'MemoryMeasurement': 'memory',
    'report': 'report',
    'pipeline': 'pipeline', 'Pipeline': 'pipeline', 'split_model': 'pipeline', 'PipelineSplit': 'pipeline',
    'PipelineTimeline': 'pipeline', 'PipelineTimelines': 'pipeline', 'simulate_schedule': 'pipeline',
    'schedule_order': 'pipeline', 'bubble_fraction': 'pipeline',
    'bench_matmul': 'bench', 'bench_memory': 'bench', 'bench_collectives': 'bench', 'bench_model': 'bench',
    'bench_scaling': 'bench', 'bench_all': 'bench', 'cost_per_experiment': 'bench', 'BenchResult': 'bench', 'time_fn': 'bench',
    'full_state_dict': 'fsdp', 'check_optimizer': 'fsdp', 'find_blocks': 'fsdp',
    'Degrees': 'parallel', 'parallelize': 'parallel', 'tp_plan': 'parallel', 'apply_tp': 'parallel', 'data_rank': 'parallel',
}

def __getattr__(name):
    mod = _API.get(name)
    if mod is None: raise AttributeError(f"module 'dtnb' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(f'dtnb.{mod}'), name)

def __dir__(): return sorted(list(globals()) + list(_API))
