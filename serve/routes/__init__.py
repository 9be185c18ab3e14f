"""The API's routes, one router per concern; :func:`serve.app.create_app` mounts them all."""
