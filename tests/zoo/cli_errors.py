"""The check every bad-input test of the command line makes: ``zoo`` exits with status 2 and prints one line,
``zoo: error: ...``, with no traceback."""
from zoo.cli import main


def one_line_error(capsys, *argv) -> str:
    """Run ``zoo *argv`` in process and return its one-line error (asserting the exit status and the form)."""
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("zoo: error: ") and "Traceback" not in err, err
    return err
