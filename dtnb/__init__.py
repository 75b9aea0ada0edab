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
}

def __getattr__(name):
    mod = _API.get(name)
    if mod is None: raise AttributeError(f"module 'dtnb' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(f'dtnb.{mod}'), name)

def __dir__(): return sorted(list(globals()) + list(_API))
