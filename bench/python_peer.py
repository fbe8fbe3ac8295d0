"""llama-cpp-python's OpenAI-compatible server, started with a weight-buffer choice.

Usage: python -m bench.python_peer on|off SERVER-ARGUMENTS...

That server has no option for llama.cpp's extra weight buffer types (`use_extra_bufts`), and
its default crashes on CPUs that offer AMX (adapter/weight_buffers.py). Every model it
loads starts from the binding's `llama_model_default_params()`, so this entry point wraps
that function with the choice, then runs the server's own `__main__`.
"""

from __future__ import annotations

import runpy
import sys

import llama_cpp.llama_cpp as binding

CHOICES = {"on": True, "off": False}


def use_extra_buffers(use_extra: bool) -> None:
    """Make every later model load in this process take `use_extra_bufts=use_extra`."""
    defaults = binding.llama_model_default_params

    def with_choice() -> binding.llama_model_params:
        params: binding.llama_model_params = defaults()
        params.use_extra_bufts = use_extra
        return params

    binding.llama_model_default_params = with_choice


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in CHOICES:
        sys.exit(f"usage: python -m bench.python_peer {'|'.join(CHOICES)} SERVER-ARGUMENTS...")
    use_extra_buffers(CHOICES[sys.argv[1]])
    sys.argv = ["llama_cpp.server", *sys.argv[2:]]
    runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
