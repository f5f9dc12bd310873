import sys

from moestream.commands import main

sys.exit(main())
