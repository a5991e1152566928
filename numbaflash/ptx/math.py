"""Special functions beyond ``convert`` (``ptx/math.cu``): the fast tanh that softcapping uses
(scores become softcap · tanh(scores / softcap))."""

from __future__ import annotations

from numba import types

from ._declare import declare

_f32 = types.float32
tanh = declare("math", "tanh_approx_f32", _f32(_f32))
tanh.__doc__ = "tanh(x) -> tanh(x) (tanh.approx.f32: relative error about 2^-11; tanh(+-inf) = +-1)."
