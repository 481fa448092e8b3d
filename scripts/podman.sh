# podman as this project runs it (sourced by image.sh and the container tests):
# runc with cgroupfs (crun refuses a hybrid cgroup hierarchy; cgroupfs needs no
# systemd), and limits that the runtime can set without CAP_SYS_RESOURCE: no
# higher than the caller's own hard limits (20000 open files, 4096 processes).
spanlet_podman() {
  local sub=$1; shift
  local n u
  n=$(ulimit -Hn); u=$(ulimit -Hu)
  [ "$n" = unlimited ] || [ "$n" -gt 20000 ] && n=20000
  [ "$u" = unlimited ] || [ "$u" -gt 4096 ] && u=4096
  case $sub in
    build|run|create)
      podman --runtime runc --cgroup-manager=cgroupfs "$sub" \
        --ulimit "nofile=$n:$n" --ulimit "nproc=$u:$u" "$@" ;;
    *) podman --runtime runc --cgroup-manager=cgroupfs "$sub" "$@" ;;
  esac
}
