"""A stand-in for torchvision, first on the PYTHONPATH of SGLang's side in tests (tests/support/sglang_env.py).

SGLang imports torchvision at module load (its multimodal utils, `import torchvision.transforms as T`), and
so does transformers when SGLang's processor lookup walks its auto-classes (a video processor evaluates
`PILImageResampling | InterpolationMode` at import). The registry's torchvision needs a CUDA build of torch:
beside this CPU torch its C++ operators do not register and it fails to import. What the tests drive of
SGLang (its receiver, its unpickler, its Qwen-VL prompt building on precomputed embeddings) never calls
torchvision, so a package whose every name is a placeholder is enough. It has no dist-info, so
`transformers.is_torchvision_available()` stays False and transformers takes its non-torchvision paths.
"""

import sys

from torchvision._stub import module_getattr, placeholder_module

__version__ = "0.0.0+stub"
__getattr__ = module_getattr(__name__)

# Registered up front: `import torchvision.transforms.v2.functional as F` needs each level in sys.modules.
for _name in ("transforms", "transforms.functional", "transforms.v2", "transforms.v2.functional", "io", "ops",
              "ops.boxes", "models", "datasets", "utils"):
    _parent, _, _leaf = f"{__name__}.{_name}".rpartition(".")
    setattr(sys.modules[_parent], _leaf, placeholder_module(f"{__name__}.{_name}"))
