"""The API's routes, one router per concern; :func:`jaxdsa.serve.app.create_app` mounts them all."""
