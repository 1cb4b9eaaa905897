"""``kfac_jax.patches_second_moment``: not served (kfacx's convolution blocks compute
their input statistics themselves)."""

from kfacx.kfac_jax._unsupported import unsupported

_INSTEAD = (
    "kfacx.ConvTwoKroneckerFactored computes the patches' second moment of a convolution "
    "layer itself; register the layer (or let detection find it)"
)
patches_moments = unsupported("patches_moments", _INSTEAD)
patches_moments_explicit = unsupported("patches_moments_explicit", _INSTEAD)
