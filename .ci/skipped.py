"""Print the node ids of the tests a JUnit XML file records as skipped, one per line."""

import pathlib
import sys
import xml.etree.ElementTree as ET

root = pathlib.Path.cwd()
for case in ET.parse(sys.argv[1]).iter("testcase"):
  if case.find("skipped") is None:
    continue
  if not case.get("classname"):  # a module skipped whole at collection: name is tests.test_x
    print(case.get("name").replace(".", "/") + ".py")
    continue
  parts = case.get("classname").split(".")  # tests.test_x or tests.test_x.TestClass
  for i in range(len(parts), 0, -1):
    if (root / ("/".join(parts[:i]) + ".py")).exists():
      print("::".join(["/".join(parts[:i]) + ".py", *parts[i:], case.get("name")]))
      break
  else:
    sys.exit(f"no test file for {case.get('classname')}")
