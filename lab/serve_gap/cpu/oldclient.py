import importlib.util, sys
spec = importlib.util.spec_from_file_location('jaxengine.benchmarks.serve', '/tmp/sg/serve_httpx.py')
m = importlib.util.module_from_spec(spec); sys.modules['jaxengine.benchmarks.serve'] = m; spec.loader.exec_module(m)
from jaxengine.cli import main
sys.argv = ['jaxengine'] + sys.argv[1:]
sys.exit(main())
