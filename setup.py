"""Builds the optional C fast paths of mining (marft_lg/trajectories/): _otlp_c.c, the trace reader;
_columns_c.c, column conversions. All metadata is in pyproject.toml.
Without a C compiler the install still succeeds and mining uses its pure-Python code."""

from setuptools import Extension, setup

setup(ext_modules=[Extension(f"marft_lg.trajectories.{name}", [f"marft_lg/trajectories/{name}.c"],
                             extra_compile_args=["-O2"], optional=True)
                   for name in ("_otlp_c", "_columns_c")])
