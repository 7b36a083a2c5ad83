"""megatron_oases.layers."""


def refuse_unsupported(layer: str, **arguments) -> None:
    """Raise for the first of Megatron's attention ``arguments`` that is set: our attention
    layers support learned absolute positions and self-attention only."""
    for name, value in arguments.items():
        if value is not None:
            raise NotImplementedError(f"{layer}: {name} is not supported yet "
                                      "(use --position-embedding-type learned_absolute)")
