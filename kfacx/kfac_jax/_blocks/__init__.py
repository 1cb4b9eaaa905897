"""kfac-jax's curvature-block protocol (`CurvatureBlock`, `KroneckerFactored`, ...), for
blocks written against kfac-jax, and their hosting inside kfacx's estimator
(`HostedBlock`)."""
