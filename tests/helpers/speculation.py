"""Speculation settings tests share."""

# speculation.specinfer_temperature above any request's temperature (the API's largest is 2): a
# specexec engine grows SpecExec trees at every temperature, so a test parametrized by method tests
# the trees it names
NAMED_TREES = 3.0
