# The two entry points of the README. Both install dependencies (Debian packages), configure,
# build and then run: `make demo` the training demo, `make test` every test.
BUILD_DIR ?= build
SANITIZE ?=
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=

.PHONY: all deps configure build demo test test-unit test-asan test-tsan format clean

all: build

deps:
	./scripts/install-deps.sh

configure: deps
	cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DTENSORVERBS_WERROR=ON -DSANITIZE=$(SANITIZE) $(CMAKE_FLAGS)

build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS)

demo: build
	$(BUILD_DIR)/tools/tensorverbs demo

test: build
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS) --label-exclude hw

test-unit: build
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS) -L unit

# Sanitizer builds of the unit and conformance tests, in their own build directories.
test-asan:
	$(MAKE) build BUILD_DIR=build-asan SANITIZE=address
	cd build-asan && ASAN_OPTIONS=allocator_may_return_null=1:detect_leaks=1 \
	  ctest --output-on-failure -j $(JOBS) -L 'unit|conformance'

test-tsan:
	$(MAKE) build BUILD_DIR=build-tsan SANITIZE=thread
	cd build-tsan && TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:allocator_may_return_null=1:suppressions=$(CURDIR)/cmake/tsan.supp \
	  ctest --output-on-failure -j $(JOBS) -L 'unit|conformance'

format:
	find src tools tests -name '*.h' -o -name '*.cc' | xargs clang-format -i

clean:
	rm -rf build build-asan build-tsan
