"""The one error type for unreadable checkpoints; it always names the file and the tensor."""


class CheckpointError(ValueError):
    def __init__(self, file: str, tensor: str, message: str):
        self.file, self.tensor = file, tensor
        super().__init__(f"{file}: tensor '{tensor}': {message}")
