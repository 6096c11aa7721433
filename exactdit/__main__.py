"""``python -m exactdit`` runs the command-line interface."""

from exactdit.cli import main

if __name__ == "__main__":  # pragma: no cover
    main()
