# Our own short configurator, in the shape of karpathy/nanoGPT's configurator.py (MIT): the
# training script exec()s this file; each command-line argument is either a config file (a
# Python file exec'd here) or --key=value, overriding a global of the script. Values are read
# as Python literals (else kept as strings) and must keep the default's type.
import sys
from ast import literal_eval

for _arg in sys.argv[1:]:
    if not _arg.startswith('--'):
        print(f"config file {_arg}")
        exec(open(_arg).read())
        continue
    _key, _sep, _text = _arg[2:].partition('=')
    if not _sep or _key not in globals():
        raise ValueError(f"unknown or malformed option {_arg}")
    try:
        _value = literal_eval(_text)
    except (SyntaxError, ValueError):
        _value = _text
    if type(_value) is not type(globals()[_key]):
        raise TypeError(f"{_key}={_value!r}: expected {type(globals()[_key]).__name__}")
    print(f"override {_key} = {_value!r}")
    globals()[_key] = _value
