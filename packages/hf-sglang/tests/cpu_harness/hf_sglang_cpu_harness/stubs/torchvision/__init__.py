"""TEST-ONLY placeholder for ``torchvision`` (see the harness README): import-time names only.

SGLang imports ``torchvision.transforms`` in vision-model modules that load with every engine;
text models never call into it.  Anything actually used raises.
"""

__version__ = "0.0.0+hf-sglang-cpu-harness"
IS_HF_SGLANG_TEST_STAND_IN = True
