import jax

# Eight CPU devices for the mesh tests (must happen before JAX creates its CPU client).
jax.config.update("jax_num_cpu_devices", 8)
