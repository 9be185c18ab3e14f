"""Model definitions: config -> params pytree -> pure step function."""
