"""exactdit: bit-exact fused kernels for diffusers DiTs."""
