"""The one compiled part of qtool: fused CPU kernels (qtool/native). Everything else is in
pyproject.toml. The extension is optional: without a C compiler qtool installs and runs on
its torch kernels alone, only slower (`qtool.native.available()` says which)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "qtool.native._kernels",
            sources=[
                "qtool/native/src/module.c",
                "qtool/native/src/common.c",
                "qtool/native/src/affine.c",
                "qtool/native/src/mse.c",
                "qtool/native/src/gguf.c",
                "qtool/native/src/gguf_encode.c",
                "qtool/native/src/kquant_encode.c",
                "qtool/native/src/kquant_common.c",
                "qtool/native/src/sums.c",
                "qtool/native/src/iq3_encode.c",
                "qtool/native/src/iq2_encode.c",
                "qtool/native/src/iq_grid.c",
                "qtool/native/src/gptq.c",
            ],
            depends=[
                "qtool/native/src/qtool_native.h",
                "qtool/native/src/kquant_lanes.h",
                "qtool/native/src/iq3_grids.h",
                "qtool/native/src/iq2_grids.h",
                "qtool/native/src/iq_grid.h",
            ],
            # bit-exact with torch: no FMA contraction, no fast-math
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-strict-aliasing", "-std=c11"],
            optional=True,
        )
    ]
)
