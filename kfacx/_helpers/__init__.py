"""What every wing of kfacx leans on; it imports nothing of kfacx but `kfacx.tags`.

* ``_jaxpr``: reading and rewriting jaxprs (interpreting equations, where values come
  from, dead-code and tag passes), for detection, the tracer and the checks;
* ``_checks``: argument checks that raise kfacx's `ValueError` / `TypeError`
  naming the parameter and the fix;
* ``_paths``: parameter paths as users read them (``"mlp/~/linear_0/w"``);
* ``_tree``: pytree arithmetic in float32 or wider (inner products, Gram matrices);
* ``_views`` and ``_elementwise``: how a parameter is seen by a layer (a slice, a
  transpose, a reshape, an elementwise map), shared by detection and the blocks;
* ``_compile``: XLA's fast-compile options;
* ``_user_warnings``: kfacx's warnings, raised at the user's line.
"""
