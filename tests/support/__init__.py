"""What the tests share: tensors of every kind (tensors), independent references written from the
specifications (pxh64_reference, formats_reference), models (integrations_models), the multi-process
harnesses and their worker scripts (gather_*, te_*), fresh interpreters (processes), simulated CUDA
devices (simulated_cuda) and the helpers one subject's CPU and GPU tests both use. No test module
imports another: what two of them need lives here. tests/ is on sys.path (pyproject's pytest
``pythonpath``; worker scripts put it there themselves), so these import as ``support.<module>``."""
