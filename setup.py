"""Builds the optional C fast path of the trace reader (marft_lg/trajectories/_otlp_c.c); all metadata is in
pyproject.toml. Without a C compiler the install still succeeds and mining uses its pure-Python readers."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("marft_lg.trajectories._otlp_c", ["marft_lg/trajectories/_otlp_c.c"],
                             extra_compile_args=["-O2"], optional=True)])
